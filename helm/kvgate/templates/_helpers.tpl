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

{{- /* kvgate's config with the listen addresses the chart owns */ -}}
{{- define "kvgate.config" -}}
{{- $server := dict "grpc_address" (printf "0.0.0.0:%d" (int .Values.ports.grpc)) "metrics_address" (printf "0.0.0.0:%d" (int .Values.ports.metrics)) -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "server" (merge $server (default (dict) $cfg.server)) -}}
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
pools:
{{- range .Values.pools }}
  {{ .name }}:
    min_replicas: {{ .minReplicas }}
    max_replicas: {{ .maxReplicas }}
    step: {{ .step }}
    scale_up_threshold: {{ .scaleUpThreshold }}
    scale_down_threshold: {{ .scaleDownThreshold }}
    cooldown_seconds: {{ .cooldownSeconds }}
    warm_pool: {{ .warmPool }}
{{- end }}
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
