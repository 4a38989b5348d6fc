-- kvgate's Envoy-side helper (LuaJIT, runs inside Envoy after kvgate's ext_proc filter).
--
-- Request: removes client-supplied x-kvgate-* headers and, unless Envoy runs fail-open, refuses a
-- request that kvgate never saw (a POST without a body skips the buffered-body message), and holds
-- each inference request until kvgate has decided on its body.
-- Response: copies the final `usage` of admitted requests (cached and reasoning tokens included, when
-- reported) into dynamic metadata `kvgate.usage`, which
-- Envoy's gRPC access log hands to kvgate when the stream ends. Chat/completions and embeddings
-- report prompt_tokens/completion_tokens (embeddings: no completion_tokens, recorded as 0); the
-- Responses API reports input_tokens/output_tokens. For streaming responses it looks at each chunk
-- once, in C, records the last usage seen (with stream_options.continuous_usage_stats every chunk
-- carries one) and strips the usage-only final chunk (`"choices":[]`) again when kvgate itself asked
-- for it. SSE events may be separated by "\n\n" or "\r\n\r\n"; either passes through unchanged.
--
-- kvgate/envoy_config.py fills in the three lines below when it renders the filter.
local FAIL_OPEN = false
local MISSING_BODY = nil
local MISSING_STATUS = nil

local USAGE = '"usage"%s*:%s*{'

local function record(h, s)
  local p = string.match(s, '"prompt_tokens"%s*:%s*(%d+)')
  local c
  if p ~= nil then
    c = string.match(s, '"completion_tokens"%s*:%s*(%d+)')
  else
    p = string.match(s, '"input_tokens"%s*:%s*(%d+)')
    c = string.match(s, '"output_tokens"%s*:%s*(%d+)')
  end
  if p ~= nil then
    local md = h:streamInfo():dynamicMetadata()
    md:set("kvgate.usage", "prompt_tokens", tonumber(p))
    md:set("kvgate.usage", "completion_tokens", tonumber(c or "0"))
    -- spend budgets price them apart: prompt tokens served from the prefix cache (vLLM's
    -- usage.prompt_tokens_details.cached_tokens) and reasoning tokens among the completion's
    local cached = string.match(s, '"cached_tokens"%s*:%s*(%d+)')
    if cached ~= nil then
      md:set("kvgate.usage", "cached_tokens", tonumber(cached))
    end
    local reasoning = string.match(s, '"reasoning_tokens"%s*:%s*(%d+)')
    if reasoning ~= nil then
      md:set("kvgate.usage", "reasoning_tokens", tonumber(reasoning))
    end
  end
end

function envoy_on_request(h)
  local headers = h:headers()
  local drop = {}
  for k, _ in pairs(headers) do
    if string.sub(k, 1, 9) == "x-kvgate-" then
      drop[#drop + 1] = k
    end
  end
  for _, k in ipairs(drop) do
    headers:remove(k)
  end
  if h:streamInfo():dynamicMetadata():get("kvgate") == nil then
    -- Inference routes: kvgate decides on the buffered body, after these headers have passed the
    -- ext_proc filter. Waiting for the body here holds the request until that decision is in, so
    -- nothing reaches the upstream first.
    h:body()
    -- (handles from before the wait are out of scope after it: look the metadata up again)
    if h:streamInfo():dynamicMetadata():get("kvgate") == nil and not FAIL_OPEN then
      h:respond(
        {[":status"] = MISSING_STATUS, ["content-type"] = "application/json",
         ["x-kvgate-reject-reason"] = "missing-body"},
        MISSING_BODY
      )
      return
    end
  end
  -- Only kvgate chooses the node: it names it in metadata (set with the body decision, after these
  -- headers had passed ext_proc) and this writes it into the header the ORIGINAL_DST cluster reads.
  -- A client's own value is dropped, so nobody can steer a request to an address of their choosing.
  local kv = h:streamInfo():dynamicMetadata():get("kvgate")
  if kv ~= nil and kv["endpoint"] ~= nil then
    h:headers():replace("x-gateway-destination-endpoint", kv["endpoint"])
  else
    h:headers():remove("x-gateway-destination-endpoint")
  end
  -- A response that will not be streamed: its first byte is the whole answer, so it goes to the route
  -- whose first-byte and idle timeouts are long enough for a whole generation.
  if kv ~= nil and kv["buffered"] == true then
    h:headers():replace("x-kvgate-buffered", "1")
    h:clearRouteCache()
  end
end

local function event_end(s, from)
  -- the position just after the blank line that ends the SSE event containing `from`, or nil
  local lf = string.find(s, "\n\n", from, true)
  local crlf = string.find(s, "\r\n\r\n", from, true)
  if lf ~= nil and (crlf == nil or lf < crlf) then
    return lf + 2
  end
  if crlf ~= nil then
    return crlf + 4
  end
  return nil
end

local function event_start(s, from, before)
  -- where the SSE event holding `before` begins: just after the last event end in [from, before]
  local start = from
  while true do
    local e = event_end(s, start)
    if e == nil or e > before then
      return start
    end
    start = e
  end
end

local function last_usage(s)
  local at = nil
  local pos = 1
  while true do
    local a = string.find(s, USAGE, pos)
    if a == nil then
      return at
    end
    at, pos = a, a + 1
  end
end

function envoy_on_response(h)
  local kv = h:streamInfo():dynamicMetadata():get("kvgate")
  if kv == nil or kv["ticket"] == nil then
    return
  end
  if kv["budget_remaining"] ~= nil then
    -- what is left of the tenant's spend budgets once this request's worst case was reserved
    h:headers():replace("x-kvgate-budget-remaining", kv["budget_remaining"])
  end
  local ct = h:headers():get("content-type") or ""
  if string.find(ct, "text/event-stream", 1, true) == nil then
    local body = h:body()
    if body ~= nil then
      local n = body:length()
      local from = 0
      if n > 8192 then
        from = n - 8192 -- usage is near the end of an OpenAI response object: look there first
      end
      local s = body:getBytes(from, n - from)
      local a = last_usage(s)
      if a == nil and from > 0 then
        -- a large field after it (vLLM's prompt_logprobs, kv_transfer_params): the whole body, once
        s = body:getBytes(0, n)
        a = last_usage(s)
      end
      if a ~= nil then
        record(h, string.sub(s, a))
      end
    end
    return
  end
  local strip = kv["strip_usage"] == true
  local pending = nil
  for chunk in h:bodyChunks() do
    local n = chunk:length()
    if n > 0 or pending ~= nil then
      local s = chunk:getBytes(0, n)
      local changed = false
      if pending ~= nil then
        s = pending .. s
        pending = nil
        changed = true
      end
      local pos = 1
      while true do
        local a = string.find(s, USAGE, pos)
        if a == nil then
          break
        end
        local st = event_start(s, pos, a)
        local e = event_end(s, a)
        if e == nil then
          break -- split across chunks: held back below
        end
        record(h, string.sub(s, a, e - 1))
        local empty = string.find(s, '"choices"%s*:%s*%[%s*%]', st)
        if strip and empty ~= nil and empty < e then
          -- the usage-only chunk kvgate asked for: the client did not
          s = string.sub(s, 1, st - 1) .. string.sub(s, e)
          changed = true
          pos = st
        else
          pos = e
        end
      end
      -- Hold back an event that is not complete yet (no client can use half an event): it is
      -- parsed, and stripped if need be, once its end arrives with the next chunk (the stream's
      -- end-of-stream chunk, empty for vLLM's chunked HTTP/1.1, flushes what is left).
      local tail = event_start(s, pos, #s + 1)
      if tail <= #s and n > 0 then
        pending = string.sub(s, tail)
        s = string.sub(s, 1, tail - 1)
        changed = true
      end
      if changed then
        chunk:setBytes(s)
      end
    end
  end
end
