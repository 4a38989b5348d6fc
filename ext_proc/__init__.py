"""kvgate's admission service: the decision core and the gRPC shell Envoy talks to.

Where things are decided:

* ``identity``  — which tenant a request belongs to (API key → tenant), 401 for unknown keys;
* ``estimate``  — how many tokens a request will cost, from its JSON body;
* ``limits``    — token buckets and their arithmetic (pure, clock injected);
* ``admission`` — the decision itself: 400/413 size caps, 429 policy, 503 capacity, admit;
* ``wire``      — how a decision looks on the wire (status, headers, OpenAI-style body);
* ``server``    — the grpc.aio ExternalProcessor + access-log shell around the core.

Its performance priors, ``profiles`` (step-time coefficients and limits per model/GPU, the starting
point of ``nodes.performance``), are also what the simulated nodes in ``sim/`` run on.
"""
