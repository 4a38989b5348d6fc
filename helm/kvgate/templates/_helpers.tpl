{{- define "kvgate.name" -}}kvgate{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if contains "kvgate" .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-kvgate" .Release.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
app.kubernetes.io/name: kvgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvgate.selector" -}}
app.kubernetes.io/name: kvgate
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvgate.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- /* the store's Redis URL: store.redis.url, else the chart's Redis when redis.enabled, else "" (no store) */ -}}
{{- define "kvgate.redisUrl" -}}
{{- if .Values.store.redis.url -}}{{ .Values.store.redis.url }}
{{- else if .Values.redis.enabled -}}redis://{{ include "kvgate.fullname" . }}-redis.{{ .Release.Namespace }}.svc.cluster.local:6379/0
{{- end -}}
{{- end -}}

{{- /* The Secret holding the chart's own Redis's password (redis.enabled): store.redis.existingSecret, else
the one the chart generates (redis.yaml), so that the Redis never runs without a password. */ -}}
{{- define "kvgate.chartRedisSecret" -}}
{{- .Values.store.redis.existingSecret | default (printf "%s-redis" (include "kvgate.fullname" .)) -}}
{{- end -}}

{{- /* its key: store.redis.passwordKey in yours, "password" in the generated one */ -}}
{{- define "kvgate.redisPasswordKey" -}}
{{- if .Values.store.redis.existingSecret -}}{{ .Values.store.redis.passwordKey }}{{- else -}}password{{- end -}}
{{- end -}}

{{- /* The Secret mounted as kvgate's password_file: store.redis.existingSecret, else the generated one when
the store is the chart's own Redis, else "" (your Redis without a password, or no store). */ -}}
{{- define "kvgate.redisPasswordSecret" -}}
{{- if .Values.store.redis.existingSecret -}}{{ .Values.store.redis.existingSecret }}
{{- else if and .Values.redis.enabled (not .Values.store.redis.url) -}}{{ include "kvgate.chartRedisSecret" . }}
{{- end -}}
{{- end -}}

{{- /* where the store's Secrets are mounted in kvgate's pods */ -}}
{{- define "kvgate.redisPasswordDir" -}}/etc/kvgate-redis/password{{- end -}}
{{- define "kvgate.redisCaDir" -}}/etc/kvgate-redis/ca{{- end -}}

{{- /* kvgate's store.redis, from the chart's store.redis values (empty: no store) */ -}}
{{- define "kvgate.store" -}}
{{- $url := include "kvgate.redisUrl" . -}}
{{- $r := .Values.store.redis -}}
{{- if and (gt (int .Values.replicaCount) 1) (not $url) -}}
{{- fail (printf "replicaCount: %d needs a shared store (without one each replica would enforce its own copy of every quota). Set one of: redis.enabled: true (the chart's own single-pod Redis, with a generated password); store.redis.url: redis://HOST:6379/0 (your Redis/Valkey; its password in store.redis.existingSecret); or replicaCount: 1" (int .Values.replicaCount)) -}}
{{- end -}}
{{- if and .Values.redis.enabled $r.url (not $r.existingSecret) -}}
{{- fail "redis.enabled with store.redis.url: the chart's own Redis runs with a generated password that kvgate is given only when store.redis.url is empty (kvgate then finds that Redis by itself). Leave store.redis.url empty to use the chart's Redis, or set redis.enabled: false to use yours (its password in store.redis.existingSecret)" -}}
{{- end -}}
{{- if $url -}}
{{- if and $r.tls.enabled (not (hasPrefix "rediss://" $url)) -}}
{{- fail "store.redis.tls.enabled needs a rediss:// store.redis.url (the chart's own redis speaks no TLS)" -}}
{{- end -}}
{{- $prefix := $r.keyPrefix | default .Release.Name -}}
{{- if not (regexMatch "^[A-Za-z0-9_.:-]{1,64}$" $prefix) -}}
{{- fail (printf "store.redis.keyPrefix %q must match ^[A-Za-z0-9_.:-]{1,64}$ (set it when the release name does not)" $prefix) -}}
{{- end -}}
{{- $s := dict "url" $url "key_prefix" $prefix "expected_replicas" (int .Values.replicaCount) -}}
{{- if include "kvgate.redisPasswordSecret" . -}}
{{- $_ := set $s "password_file" (printf "%s/password" (include "kvgate.redisPasswordDir" .)) -}}
{{- end -}}
{{- if and $r.tls.enabled $r.tls.caSecret -}}
{{- $_ := set $s "tls_ca_file" (printf "%s/ca.crt" (include "kvgate.redisCaDir" .)) -}}
{{- end -}}
{{- range $key, $name := dict "syncIntervalMs" "sync_interval_ms" "leaseTtlSeconds" "lease_ttl_seconds" "timeoutMs" "timeout_ms" "fallbackAfterSeconds" "fallback_after_seconds" -}}
{{- if hasKey $r $key -}}
{{- $_ := set $s $name (get $r $key) -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "redis" $s) -}}
{{- end -}}
{{- end -}}

{{- /* kvgate's config with the listen addresses and the store the chart owns */ -}}
{{- define "kvgate.config" -}}
{{- $server := dict "grpc_address" (printf "0.0.0.0:%d" (int .Values.ports.grpc)) "metrics_address" (printf "0.0.0.0:%d" (int .Values.ports.metrics)) -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "server" (merge $server (default (dict) $cfg.server)) -}}
{{- if hasKey $cfg "store" -}}
{{- fail "config.store: set the store with the chart's store.redis (and redis.enabled) values, which also mount its Secrets" -}}
{{- end -}}
{{- $store := include "kvgate.store" . -}}
{{- if $store -}}
{{- $_ := set $cfg "store" (fromYaml $store) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{- define "kvgate.scalerConfig" -}}
grpc_address: "0.0.0.0:{{ .Values.scaler.port }}"
metrics_address: "0.0.0.0:{{ .Values.scaler.metricsPort }}"
window_seconds: {{ .Values.scaler.windowSeconds }}
interval_seconds: {{ .Values.scaler.intervalSeconds }}
source:
{{- if eq .Values.scaler.source "prometheus" }}
  prometheus: {{ required "scaler.prometheusUrl is required when scaler.source is prometheus" .Values.scaler.prometheusUrl | quote }}
  job: {{ .Values.scaler.prometheusJob | quote }}
{{- else }}
  kvgate_dns: "{{ include "kvgate.fullname" . }}-metrics.{{ .Release.Namespace }}.svc.cluster.local:{{ .Values.ports.metrics }}"
{{- end }}
{{ include "kvgate.scalerPools" . }}
{{- end -}}

{{- /* pools[] entries with poolDefaults under them, checked: a list under "pools" (YAML). Keys are
overlaid one by one (hasKey, not `default` or `merge`, which take 0 and false for unset). */ -}}
{{- define "kvgate.pools" -}}
{{- $defaults := default (dict) .Values.poolDefaults -}}
{{- $kvgate := list -}}
{{- range (default (list) .Values.config.pools) -}}
{{- $kvgate = append $kvgate .name -}}
{{- end -}}
{{- $seen := dict -}}
{{- $out := list -}}
{{- range $i, $entry := .Values.pools -}}
{{- if hasKey $seen $entry.name -}}
{{- fail (printf "pools[%d].name: %q is listed twice (one ScaledObject and one scaler pool per kvgate pool)" $i $entry.name) -}}
{{- end -}}
{{- $_ := set $seen $entry.name true -}}
{{- if and $kvgate (not (has $entry.name $kvgate)) -}}
{{- fail (printf "pools[%d].name: %q is not a pool of config.pools (%s): its ScaledObject would scale on no signal; name each entry after the kvgate pool its Deployment serves" $i $entry.name (join ", " $kvgate)) -}}
{{- end -}}
{{- $p := deepCopy $defaults -}}
{{- range $k, $v := $entry -}}
{{- $_ := set $p $k $v -}}
{{- end -}}
{{- range $key := list "minReplicas" "maxReplicas" "step" "cooldownSeconds" -}}
{{- if not (hasKey $p $key) -}}
{{- fail (printf "pools[%d].%s: required (in the entry or in poolDefaults)" $i $key) -}}
{{- end -}}
{{- end -}}
{{- /* what the scaler's config refuses at start (a crash-looping scaler): refused here, at install */ -}}
{{- if gt (int $p.minReplicas) (int $p.maxReplicas) -}}
{{- fail (printf "pools[%d].minReplicas: %d is above maxReplicas (%d)" $i (int $p.minReplicas) (int $p.maxReplicas)) -}}
{{- end -}}
{{- /* (0.25: the scaler's default, scaler/config.py Pool.scale_up_threshold; tests/test_helm.py checks both) */ -}}
{{- $up := ternary $p.scaleUpThreshold 0.25 (hasKey $p "scaleUpThreshold") -}}
{{- if and (hasKey $p "scaleDownThreshold") (ge (float64 $p.scaleDownThreshold) (float64 $up)) -}}
{{- fail (printf "pools[%d].scaleDownThreshold: %v must be below scaleUpThreshold (%v)" $i $p.scaleDownThreshold $up) -}}
{{- end -}}
{{- $out = append $out $p -}}
{{- end -}}
{{- toYaml (dict "pools" $out) -}}
{{- end -}}

{{- /* the scaler's pools.<name>: each entry's law settings, those set only */ -}}
{{- define "kvgate.scalerPools" -}}
{{- $pools := dict -}}
{{- $names := dict "minReplicas" "min_replicas" "maxReplicas" "max_replicas" "step" "step" "scaleUpThreshold" "scale_up_threshold" "scaleDownThreshold" "scale_down_threshold" "cooldownSeconds" "cooldown_seconds" "warmPool" "warm_pool" "concentration" "concentration" "coldStartSeconds" "cold_start_seconds" "trendWindowSeconds" "trend_window_seconds" "spreadShare" "spread_share" "spreadTenants" "spread_tenants" "scaleDownKvUsage" "scale_down_kv_usage" "scaleDownPrefillUsage" "scale_down_prefill_usage" "scaleDownWindowSeconds" "scale_down_window_seconds" "warmPoolKvUsage" "warm_pool_kv_usage" "hpaTolerance" "hpa_tolerance" -}}
{{- range (fromYaml (include "kvgate.pools" .)).pools -}}
{{- $law := dict -}}
{{- $p := . -}}
{{- range $key, $name := $names -}}
{{- if hasKey $p $key -}}
{{- /* (counts as integers: a float64 of a million renders 1e+06, which the scaler reads as a string) */ -}}
{{- $_ := set $law $name (ternary (int (get $p $key)) (get $p $key) (has $key (list "minReplicas" "maxReplicas" "step" "warmPool"))) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $pools .name $law -}}
{{- end -}}
{{- toYaml (dict "pools" $pools) -}}
{{- end -}}

{{- /* the probe container, for the DaemonSet and as the sidecar recipe */ -}}
{{- define "kvgate.probeContainer" -}}
- name: kvgate-probe
  image: {{ include "kvgate.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["probe", "--vllm", "http://$(VLLM_HOST):{{ .Values.probe.daemonset.vllmPort }}", "--host", "0.0.0.0",
         "--port", "{{ .Values.probe.port }}", "--interval", "{{ .Values.probe.interval }}"]
  ports:
    - {name: probe, containerPort: {{ .Values.probe.port }}}
  readinessProbe:
    httpGet: {path: /snapshot, port: probe}
  resources:
    {{- toYaml .Values.probe.resources | nindent 4 }}
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    runAsNonRoot: true
    capabilities: {drop: [ALL]}
{{- end -}}

{{- define "kvgate.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}
