{{/* Object name for a component: <release>-<component>, or just aether-<component> when the release is "aether". */}}
{{- define "aether.name" -}}
{{- $root := index . 0 -}}{{- $component := index . 1 -}}
{{- if eq $root.Release.Name "aether" -}}
aether-{{ $component }}
{{- else -}}
{{ printf "%s-aether-%s" $root.Release.Name $component | trunc 63 | trimSuffix "-" }}
{{- end -}}
{{- end -}}

{{- define "aether.labels" -}}
{{- $root := index . 0 -}}{{- $component := index . 1 -}}
app.kubernetes.io/name: aether
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ $component }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version }}
{{- end -}}

{{- define "aether.selector" -}}
{{- $root := index . 0 -}}{{- $component := index . 1 -}}
app.kubernetes.io/name: aether
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ $component }}
{{- end -}}

{{- define "aether.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "aether.proxyImage" -}}
{{ .Values.proxyImage.repository }}:{{ .Values.proxyImage.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The registrar's in-cluster gRPC URL, for agents. */}}
{{- define "aether.registrarUrl" -}}
http://{{ include "aether.name" (list . "registrar") }}.{{ .Release.Namespace }}.svc:{{ .Values.registrar.port }}
{{- end -}}

{{/* Telemetry flags every binary takes. */}}
{{- define "aether.otelArgs" -}}
{{- if .Values.otel.enabled }}
- --otel-enabled
- --otlp-endpoint={{ required "otel.endpoint is required when otel.enabled" .Values.otel.endpoint }}
- --trace-sample-rate={{ .Values.otel.traceSampleRate }}
{{- end }}
{{- end -}}

{{/* A container securityContext: no privilege escalation, read-only root, every capability dropped but those listed. */}}
{{- define "aether.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  {{- with . }}
  add: {{ toJson . }}
  {{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "aether.env.nodeName" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end -}}

{{- define "aether.validate" -}}
{{- if and (eq .Values.registrar.store.type "embedded") (gt (int .Values.registrar.replicas) 1) -}}
{{- fail "registrar.store.type=embedded keeps the catalog on one volume: set registrar.replicas=1 or choose etcd, dynamodb or kubernetes" -}}
{{- end -}}
{{- if and (eq .Values.registrar.store.type "etcd") (empty .Values.registrar.store.etcd.endpoints) -}}
{{- fail "registrar.store.type=etcd needs registrar.store.etcd.endpoints" -}}
{{- end -}}
{{- end -}}
