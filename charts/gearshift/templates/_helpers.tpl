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

{{/*
Leader election (active/standby on a Lease): "true" unless leaderElection.enabled is false; then the
operator runs alone. Checks the values as client-go's NewLeaderElector does.
*/}}
{{- define "gearshift.leaderElection" -}}
{{- $le := .Values.leaderElection }}
{{- if $le.enabled }}
{{- $lease := float64 $le.leaseDuration }}
{{- $renew := float64 $le.renewDeadline }}
{{- $retry := float64 $le.retryPeriod }}
{{- if not (and (gt $lease $renew) (gt $renew (mulf 1.2 $retry))) }}
{{- fail (printf "leaderElection: leaseDuration (%v) must exceed renewDeadline (%v), which must exceed 1.2 × retryPeriod (%v)" $le.leaseDuration $le.renewDeadline $le.retryPeriod) }}
{{- end -}}
true
{{- else if gt (int .Values.replicaCount) 1 }}
{{- fail "replicaCount > 1 needs leaderElection.enabled: replicas without leader election would all handle every resource" }}
{{- end }}
{{- end }}

{{/* The Lease the replicas elect their leader on (in the release namespace). */}}
{{- define "gearshift.leaseName" -}}
{{- default (include "gearshift.fullname" .) .Values.leaderElection.leaseName }}
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
