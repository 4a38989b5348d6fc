-- kvgate's Envoy-side helper (LuaJIT, runs inside Envoy after kvgate's ext_proc filter).
--
-- Request: removes client-supplied x-kvgate-* headers and, unless Envoy runs fail-open, refuses a
-- request that kvgate never saw (a POST without a body skips the buffered-body message), and holds
-- each inference request until kvgate has decided on its body.
-- Response: copies the final `usage` of admitted requests into dynamic metadata `kvgate.usage`, which
-- Envoy's gRPC access log hands to kvgate when the stream ends. For streaming responses it looks at
-- each chunk once, in C, and strips the usage chunk again when kvgate itself asked for it.
local FAIL_OPEN = false

local function record(h, s)
  local p = string.match(s, '"prompt_tokens"%s*:%s*(%d+)')
  local c = string.match(s, '"completion_tokens"%s*:%s*(%d+)')
  if p ~= nil and c ~= nil then
    local md = h:streamInfo():dynamicMetadata()
    md:set("kvgate.usage", "prompt_tokens", tonumber(p))
    md:set("kvgate.usage", "completion_tokens", tonumber(c))
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
        {[":status"] = "400", ["content-type"] = "application/json", ["x-kvgate-reject-reason"] = "missing-body"},
        '{"error":{"message":"This endpoint needs a JSON request body.","type":"invalid_request_error","param":null,"code":"missing_body"}}'
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
end

local function event_start(s, before)
  -- the last "data:" at or before `before`: where the SSE event holding `before` begins
  local start, pos = 1, 1
  while true do
    local i = string.find(s, "data:", pos, true)
    if i == nil or i > before then
      return start
    end
    start, pos = i, i + 5
  end
end

function envoy_on_response(h)
  local kv = h:streamInfo():dynamicMetadata():get("kvgate")
  if kv == nil or kv["ticket"] == nil then
    return
  end
  local ct = h:headers():get("content-type") or ""
  if string.find(ct, "text/event-stream", 1, true) == nil then
    local body = h:body()
    if body ~= nil then
      local n = body:length()
      local from = 0
      if n > 8192 then
        from = n - 8192 -- usage sits at the end of an OpenAI response object
      end
      record(h, body:getBytes(from, n - from))
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
      local a = string.find(s, '"usage"%s*:%s*{')
      if a ~= nil then
        local e = string.find(s, "\n\n", a, true)
        if e == nil then
          -- the usage event is split across chunks: hold it back until its end arrives
          pending = s
          s = ""
          changed = true
        else
          record(h, string.sub(s, a, e))
          if strip then
            s = string.sub(s, 1, event_start(s, a) - 1) .. string.sub(s, e + 2)
            changed = true
          end
        end
      end
      if changed then
        chunk:setBytes(s)
      end
    end
  end
end
