{{/* The chart name, or nameOverride. */}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object name: "<release>-<chart>" unless the release name holds the chart name. */}}
{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of the operator's pods (stable across upgrades: never change them). */}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The recommended labels of every object; pass a dict with "root" and optional "component". */}}
{{- define "kvpool.labels" -}}
{{- $root := .root -}}
helm.sh/chart: {{ include "kvpool.chart" $root }}
app.kubernetes.io/name: {{ include "kvpool.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ .component | default "operator" }}
app.kubernetes.io/part-of: mooncake-kvpool
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end }}

{{/* The operator's ServiceAccount. Never the namespace's "default" one when the chart binds
the operator's rights: every Pod of the namespace that names no account runs as it. */}}
{{- define "kvpool.serviceAccountName" -}}
{{- $name := .Values.serviceAccount.name }}
{{- if and (not $name) .Values.serviceAccount.create }}
{{- $name = include "kvpool.fullname" . }}
{{- else if not $name }}
{{- $name = "default" }}
{{- end }}
{{- if and .Values.rbac.create (eq $name "default") }}
{{- $rights := "create, patch and delete Deployments, Services, ConfigMaps and NetworkPolicies; in every namespace with clusterWide=true" }}
{{- if .Values.serviceAccount.name }}
{{- fail (printf "serviceAccount.name must not be default while rbac.create is true: the bindings would give the operator's rights (%s) to every Pod running as the namespace's default ServiceAccount; name an account of the operator's own, or leave it empty with serviceAccount.create=true" $rights) }}
{{- else }}
{{- fail (printf "serviceAccount.create=false needs serviceAccount.name, an existing ServiceAccount of the operator's own: with no name the operator would run as the namespace's default ServiceAccount, and rbac.create=true would give its rights (%s) to every Pod running as it" $rights) }}
{{- end }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "kvpool.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* The namespaces watched in namespaced mode (a list, as JSON). */}}
{{- define "kvpool.watchNamespaces" -}}
{{- if .Values.watchNamespaces }}
{{- toJson (uniq .Values.watchNamespaces) }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/* How consumers get their settings: podAdmission or deploymentPatch (see injection.mode). */}}
{{- define "kvpool.injectionMode" -}}
{{- $mode := .Values.injection.mode | default (ternary "podAdmission" "deploymentPatch" .Values.webhook.enabled) }}
{{- if and (eq $mode "podAdmission") (not .Values.webhook.enabled) }}
{{- fail "injection.mode podAdmission needs webhook.enabled=true (the operator serves the mutating webhook); on a cluster that cannot run webhooks set injection.mode=deploymentPatch" }}
{{- end }}
{{- $mode }}
{{- end }}

{{/* "true" when the operator runs leader election: asked for, or needed by pod admission
(every replica answers the webhook, only the Lease holder acts). */}}
{{- define "kvpool.leaderElection" -}}
{{- if or .Values.operator.leaderElection.enabled (eq (include "kvpool.injectionMode" .) "podAdmission") }}true{{ end }}
{{- end }}

{{/* Operator replicas: as asked with leader election (two at least with pod admission), else one. */}}
{{- define "kvpool.replicas" -}}
{{- if eq (include "kvpool.injectionMode" .) "podAdmission" }}
{{- max 2 (int .Values.operator.replicas) }}
{{- else if .Values.operator.leaderElection.enabled }}
{{- .Values.operator.replicas }}
{{- else }}1{{ end }}
{{- end }}

{{- define "kvpool.webhookSecretName" -}}
{{- if .Values.webhook.certManager.enabled }}
{{- printf "%s-webhook-tls" (include "kvpool.fullname" .) }}
{{- else }}
{{- .Values.webhook.tls.secretName }}
{{- end }}
{{- end }}

{{/* The chart's webhook CA: its Certificate, Secret and Issuer share this name. */}}
{{- define "kvpool.webhookCAName" -}}
{{- printf "%s-webhook-ca" (include "kvpool.fullname" .) }}
{{- end }}

{{/* The Certificate whose CA cert-manager injects into the webhook configurations: the
chart's CA (never the serving certificate, which is renewed more often), or with an issuerRef
of your own the serving Certificate (its Secret's ca.crt: the issuer's CA). */}}
{{- define "kvpool.webhookCAFrom" -}}
{{- if .Values.webhook.certManager.issuerRef }}
{{- printf "%s-webhook" (include "kvpool.fullname" .) }}
{{- else }}
{{- include "kvpool.webhookCAName" . }}
{{- end }}
{{- end }}

{{/* Whole seconds in a Go duration such as "8760h" or "1h30m" (the schema's pattern). */}}
{{- define "kvpool.durationSeconds" -}}
{{- $ms := 0 }}
{{- $units := dict "h" 3600000 "m" 60000 "s" 1000 "ms" 1 }}
{{- range regexFindAll "[0-9]+(ms|s|m|h)" . -1 }}
{{- $number := regexFind "^[0-9]+" . }}
{{- $ms = add $ms (mul ($number | int64) (get $units (trimPrefix $number .))) }}
{{- end }}
{{- div $ms 1000 }}
{{- end }}

{{/* Where a monitor looks for pool objects: every namespace, or the watched ones. */}}
{{- define "kvpool.monitorNamespaceSelector" -}}
{{- if .Values.clusterWide }}
any: true
{{- else }}
matchNames:
{{- range (include "kvpool.watchNamespaces" . | fromJsonArray) }}
  - {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
