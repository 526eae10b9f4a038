{{/* Names and labels shared by the templates. */}}

{{- define "gearshift.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: <release>-gearshift, or the release name when it already says gearshift. */}}
{{- define "gearshift.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Cluster-scoped names carry the namespace: two releases of the same name in two namespaces differ. */}}
{{- define "gearshift.clusterName" -}}
{{- printf "%s-%s" (include "gearshift.fullname" .) .Release.Namespace | trunc 200 | trimSuffix "-" }}
{{- end }}

{{- define "gearshift.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gearshift.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gearshift.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gearshift.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "gearshift.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "gearshift.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "gearshift.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Peering (active/standby): on unless peering.enabled is false; then the operator runs standalone. */}}
{{- define "gearshift.peering" -}}
{{- if .Values.peering.enabled }}true{{- end }}
{{- if and (not .Values.peering.enabled) (gt (int .Values.replicaCount) 1) }}
{{- fail "replicaCount > 1 needs peering.enabled: standalone replicas would all handle every resource" }}
{{- end }}
{{- end }}

{{/* Handler modules passed to --disable. */}}
{{- define "gearshift.disabled" -}}
{{- $d := list }}
{{- if not .Values.profiling.enabled }}
{{- $d = append $d "gearshift.handlers.gpuprofile" }}
{{- $d = append $d "gearshift.handlers.nodes" }}
{{- end }}
{{- range .Values.disabledHandlers }}
{{- if not (has . $d) }}{{ $d = append $d . }}{{ end }}
{{- end }}
{{- toJson $d }}
{{- end }}
