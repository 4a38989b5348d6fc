import json
from pathlib import Path

import orjson
import pytest

from ext_proc.config import Estimation
from ext_proc.estimate import IMAGE_PART_TOKENS, Estimator

E = Estimator(Estimation(chars_per_token=4.0, per_message_tokens=4))


def est(doc: object, generates: bool = True, default: int = 100):  # type: ignore[no-untyped-def]
    return E.estimate(orjson.dumps(doc), generates=generates, default_max_tokens=default)


def test_chat_counts_text_and_per_message_overhead() -> None:
    e = est({"messages": [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "y" * 8}],
             "max_tokens": 50})
    assert e.parsed
    assert e.prompt_tokens == (4 + 10) + (4 + 2)
    assert e.output_tokens == 50
    assert e.total == 70


def test_content_parts_and_images() -> None:
    e = est({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "z" * 20},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100000}},
    ]}]})
    assert e.prompt_tokens == 4 + 5 + IMAGE_PART_TOKENS


def test_default_output_and_choices_multiply() -> None:
    assert est({"messages": []}).output_tokens == 100
    assert est({"prompt": "hi", "n": 3, "max_tokens": 10}).output_tokens == 30
    assert est({"prompt": "hi", "max_completion_tokens": 7, "max_tokens": 99}).output_tokens == 7
    assert est({"input": "hello world!"}, generates=False).output_tokens == 0


def test_prompt_token_ids_are_exact() -> None:
    assert est({"prompt": [1, 2, 3, 4, 5]}).prompt_tokens == 5
    assert est({"prompt": [[1, 2], [3, 4, 5]]}).prompt_tokens == 5
    assert est({"prompt": ["abcd", "abcdefgh"]}).prompt_tokens == 3


def test_stream_flags() -> None:
    e = est({"messages": [], "stream": True})
    assert e.stream and not e.include_usage
    e = est({"messages": [], "stream": True, "stream_options": {"include_usage": True}})
    assert e.include_usage


@pytest.mark.parametrize("body", [b"{not json", b"[1,2,3]", b"\xff\xfe", b'"a string"'])
def test_malformed_body_is_estimated_from_its_size(body: bytes) -> None:
    e = E.estimate(body, generates=True, default_max_tokens=64)
    assert not e.parsed
    assert e.prompt_tokens == -(-len(body) // 4)
    assert e.output_tokens == 64


def test_bad_max_tokens_fall_back_to_default() -> None:
    assert est({"prompt": "x", "max_tokens": "lots"}).output_tokens == 100
    assert est({"prompt": "x", "max_tokens": True}).output_tokens == 100
    assert est({"prompt": "x", "max_tokens": -5}).output_tokens == 100


def test_local_tokenizer_json_counts_real_tokens(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    e = Estimator(Estimation(tokenizer_json=path, per_message_tokens=0))
    r = e.estimate(json.dumps({"prompt": "hello world hello world hello"}).encode(), generates=False,
                   default_max_tokens=1)
    assert r.prompt_tokens == 5  # five words, where the char ratio would say 8
