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

{{/* The registrar's in-cluster DNS name: what its serving certificate carries and agents check. */}}
{{- define "aether.registrarHost" -}}
{{ include "aether.name" (list . "registrar") }}.{{ .Release.Namespace }}.svc
{{- end -}}

{{/* The registrar's in-cluster gRPC URL, for agents: always https:// (mTLS). */}}
{{- define "aether.registrarUrl" -}}
https://{{ include "aether.registrarHost" . }}:{{ .Values.registrar.port }}
{{- end -}}

{{/* The Secret holding the registrar's serving certificate (generated unless registrar.tls.secretName). */}}
{{- define "aether.registrarTlsSecret" -}}
{{ .Values.registrar.tls.secretName | default (printf "%s-tls" (include "aether.name" (list . "registrar"))) }}
{{- end -}}

{{/* The generated ConfigMap with the CA that verifies the registrar (ca.crt), mounted into agents. */}}
{{- define "aether.registrarCaConfigMap" -}}
{{ include "aether.name" (list . "registrar") }}-ca
{{- end -}}

{{/* The Secret holding the node CA (generated unless registrar.nodeCa.secretName). */}}
{{- define "aether.nodeCaSecret" -}}
{{ .Values.registrar.nodeCa.secretName | default (printf "%s-node-ca" (include "aether.name" (list . "registrar"))) }}
{{- end -}}

{{/* The agent's --node-identity: auto is spire with identity.provider=spire (the agent's SVID), else bootstrap. */}}
{{- define "aether.nodeIdentity" -}}
{{- if eq .Values.agent.nodeIdentity "auto" -}}
{{ ternary "spire" "bootstrap" (eq .Values.identity.provider "spire") }}
{{- else -}}
{{ .Values.agent.nodeIdentity }}
{{- end -}}
{{- end -}}

{{/* "true" when agents get node certificates from the registrar's bootstrap (node CA, TokenReviews). */}}
{{- define "aether.bootstrap" -}}
{{ eq (include "aether.nodeIdentity" .) "bootstrap" }}
{{- end -}}

{{/* Whether the registrar reads the mesh's configuration from the cluster (Gateway API routes, whose status it
writes, and Services' clusterIPs/trafficDistribution): the kubernetes store always does. */}}
{{- define "aether.registrarFromKubernetes" -}}
{{ or (eq .Values.registrar.store.type "kubernetes") .Values.registrar.fromKubernetes }}
{{- end -}}

{{/* Where the agent finds its projected bootstrap token and the registrar's CA (the agent's flag defaults). */}}
{{- define "aether.agentTokenDir" -}}/var/run/secrets/aether/registrar-token{{- end -}}
{{- define "aether.agentRegistrarCaDir" -}}/etc/aether/registrar-ca{{- end -}}

{{/* The volume with the CA that verifies the registrar (a certificate only: never the registrar's key), for the
agents and the edges. */}}
{{- define "aether.registrarCaVolume" -}}
# The CA that verifies the registrar (a certificate only: never the registrar's key).
- name: registrar-ca
  {{- if .Values.registrar.tls.caConfigMapName }}
  configMap:
    name: {{ .Values.registrar.tls.caConfigMapName }}
    items:
      - {key: ca.crt, path: ca.crt}
  {{- else if .Values.registrar.tls.secretName }}
  secret:
    secretName: {{ .Values.registrar.tls.secretName }}
    items:
      - {key: ca.crt, path: ca.crt}
    defaultMode: 0444
  {{- else }}
  configMap:
    name: {{ include "aether.registrarCaConfigMap" . }}
    items:
      - {key: ca.crt, path: ca.crt}
  {{- end }}
{{- end -}}

{{/* An edge gateway's object name (its Deployment, Service, ServiceAccount, PDB, HPA): aether-edge-<gateway>. */}}
{{- define "aether.edgeName" -}}
{{- $root := index . 0 -}}{{- $gateway := index . 1 -}}
{{ include "aether.name" (list $root (printf "edge-%s" $gateway.name)) }}
{{- end -}}

{{/* The namespace of an edge's Gateway: its own, or the release namespace. */}}
{{- define "aether.edgeGatewayNamespace" -}}
{{- $root := index . 0 -}}{{- $gateway := index . 1 -}}
{{ $gateway.namespace | default $root.Release.Namespace }}
{{- end -}}

{{/* The namespaces whose Secrets an edge may read, comma-separated: certificateNamespaces, or the Gateway's. */}}
{{- define "aether.edgeCertificateNamespaces" -}}
{{- $root := index . 0 -}}{{- $gateway := index . 1 -}}
{{- if $gateway.certificateNamespaces -}}
{{ join "," (uniq $gateway.certificateNamespaces) }}
{{- else -}}
{{ include "aether.edgeGatewayNamespace" . }}
{{- end -}}
{{- end -}}

{{/* An edge's pod selector: the edge component and its Gateway's name (unique in edge.gateways). */}}
{{- define "aether.edgeSelector" -}}
{{- $root := index . 0 -}}{{- $gateway := index . 1 -}}
{{ include "aether.selector" (list $root "edge") }}
gateway.networking.k8s.io/gateway-name: {{ $gateway.name }}
{{- end -}}

{{/* An edge's labels: the selector's, and its Gateway's namespace (what the status writer matches a Service by). */}}
{{- define "aether.edgeLabels" -}}
{{- $root := index . 0 -}}{{- $gateway := index . 1 -}}
{{ include "aether.labels" (list $root "edge") }}
gateway.networking.k8s.io/gateway-name: {{ $gateway.name }}
aether.io/gateway-namespace: {{ include "aether.edgeGatewayNamespace" . }}
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
{{- $etcd := .Values.registrar.store.etcd -}}
{{- if eq .Values.registrar.store.type "etcd" -}}
{{- if empty $etcd.endpoints -}}
{{- fail "registrar.store.type=etcd needs registrar.store.etcd.endpoints" -}}
{{- end -}}
{{- range $etcd.endpoints -}}
{{- if and $etcd.tlsSecretName (not (hasPrefix "https://" .)) -}}
{{- fail (printf "registrar.store.etcd.endpoints: %s is not https:// but registrar.store.etcd.tlsSecretName is set (TLS, the default); use https:// endpoints, or set tlsSecretName to \"\" for plaintext" .) -}}
{{- end -}}
{{- if and (not $etcd.tlsSecretName) (hasPrefix "https://" .) -}}
{{- fail (printf "registrar.store.etcd.endpoints: %s is https:// and needs registrar.store.etcd.tlsSecretName (a Secret with ca.crt)" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq (include "aether.nodeIdentity" .) "spire" -}}
{{- if ne .Values.identity.provider "spire" -}}
{{- fail "agent.nodeIdentity=spire needs identity.provider=spire (the agent's SVID comes from the SPIRE agent's Workload API)" -}}
{{- end -}}
{{- if not .Values.registrar.clientCa.configMapName -}}
{{- fail "agent.nodeIdentity=spire (the default with identity.provider=spire): the registrar verifies agents' SPIRE SVIDs with SPIRE's trust bundle; set registrar.clientCa.configMapName (a ConfigMap in the release namespace, e.g. kept by SPIRE's k8sbundle notifier), or agent.nodeIdentity=bootstrap" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.registrar.networkPolicy.enabled (empty .Values.registrar.networkPolicy.nodeCidrs) -}}
{{- fail "registrar.networkPolicy.enabled needs registrar.networkPolicy.nodeCidrs: agents run on the host network, so their connections come from node addresses" -}}
{{- end -}}
{{- if .Values.edge.enabled -}}
{{- $names := list -}}
{{- range $gateway := .Values.edge.gateways -}}
{{- if has $gateway.name $names -}}
{{- fail (printf "edge.gateways: %s is listed twice: the edge's objects are named after the Gateway's name, which must be unique in the list" $gateway.name) -}}
{{- end -}}
{{- $names = append $names $gateway.name -}}
{{- range $gateway.ports -}}
{{- if gt (add . $.Values.edge.portOffset) 65535 -}}
{{- fail (printf "edge.gateways[%s].ports: %v + edge.portOffset (%v) is above 65535" $gateway.name . $.Values.edge.portOffset) -}}
{{- end -}}
{{- end -}}
{{- $service := $gateway.service | default dict -}}
{{- if eq ($service.type | default "LoadBalancer") "ClusterIP" -}}
{{- if or $service.nodePorts $service.externalTrafficPolicy $service.loadBalancerClass $service.loadBalancerSourceRanges -}}
{{- fail (printf "edge.gateways[%s].service: nodePorts, externalTrafficPolicy, loadBalancerClass and loadBalancerSourceRanges need type LoadBalancer or NodePort" $gateway.name) -}}
{{- end -}}
{{- end -}}
{{- $ports := list -}}
{{- range $gateway.ports -}}{{- $ports = append $ports (toString .) -}}{{- end -}}
{{- range $port, $_ := $service.nodePorts -}}
{{- if not (has $port $ports) -}}
{{- fail (printf "edge.gateways[%s].service.nodePorts: %s is not one of its ports" $gateway.name $port) -}}
{{- end -}}
{{- end -}}
{{- with $gateway.hpa -}}
{{- if gt (int .minReplicas) (int .maxReplicas) -}}
{{- fail (printf "edge.gateways[%s].hpa: minReplicas is above maxReplicas" $gateway.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
