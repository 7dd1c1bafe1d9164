{{/* The chart name, and the release's full name (the prefix of every object). */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kvroute.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kvroute.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels that select the router's pods (stable across upgrades). */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* kvroute's settings file: the values above in `kvroute serve`'s snake-case keys. */}}
{{- define "kvroute.config" -}}
{{- $config := dict "policy" .Values.policy "health_interval_s" .Values.healthIntervalS "log_level" .Values.logLevel }}
{{- if .Values.discovery.enabled }}
{{- $_ := set $config "discovery" "k8s" }}
{{- $_ := set $config "k8s_selector" .Values.discovery.selector }}
{{- if .Values.discovery.port }}
{{- $_ := set $config "k8s_port" .Values.discovery.port }}
{{- end }}
{{- else }}
{{- $_ := set $config "backends" .Values.backends }}
{{- end }}
{{- if .Values.tokenizer }}
{{- $_ := set $config "tokenizer" .Values.tokenizer }}
{{- else if .Values.vllm.enabled }}
{{- $_ := set $config "tokenizer" .Values.vllm.model }}
{{- end }}
{{- if .Values.precise.enabled }}
{{- $_ := set $config "kv_events" true }}
{{- $_ := set $config "kv_events_port" .Values.precise.eventsPort }}
{{- $_ := set $config "kv_events_replay_port" .Values.precise.replayPort }}
{{- end }}
{{- if .Values.peers.enabled }}
{{- $_ := set $config "peer_bind" (printf "tcp://*:%d" (int .Values.peers.port)) }}
{{- $_ := set $config "peers_dns" (printf "%s-peers.%s.svc:%d" (include "kvroute.fullname" .) .Release.Namespace (int .Values.peers.port)) }}
{{- if .Values.peers.auth }}
{{- $_ := set $config "peer_secret_file" "/etc/kvroute-peers/secret" }}
{{- if .Values.peers.acceptedSecretKey }}
{{- $_ := set $config "peer_accepted_secret_file" "/etc/kvroute-peers/accepted" }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml (merge (deepCopy .Values.extraConfig) $config) }}
{{- end }}

{{/* The Secret holding the replicas' exchange secret (key `secret`). */}}
{{- define "kvroute.peersSecret" -}}
{{- .Values.peers.existingSecret | default (printf "%s-peer-secret" (include "kvroute.fullname" .)) }}
{{- end }}
