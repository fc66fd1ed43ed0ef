{{- define "wakegate.name" -}}wakegate{{- end -}}

{{- define "wakegate.fullname" -}}
{{- if contains "wakegate" .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-wakegate" .Release.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{/* Name of one component's objects: (dict "root" $ "component" "operator") */}}
{{- define "wakegate.component" -}}
{{- printf "%s-%s" (include "wakegate.fullname" .root) .component -}}
{{- end -}}

{{- define "wakegate.labels" -}}
app.kubernetes.io/name: wakegate
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "wakegate.selector" -}}
app.kubernetes.io/name: wakegate
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "wakegate.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Preferred anti-affinity across nodes for one component, unless the user set affinity. */}}
{{- define "wakegate.affinity" -}}
{{- if .affinity -}}
{{ toYaml .affinity }}
{{- else -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "wakegate.selector" . | nindent 12 }}
{{- end -}}
{{- end -}}

{{/* POD_IP and POD_NAMESPACE for every component: servers bind the pod IP, leases live in the namespace. */}}
{{- define "wakegate.podEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
{{- end -}}

{{- define "wakegate.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* The feeder's host as the gateway dials it: gateway.xdsHost, else its Service's DNS name. */}}
{{- define "wakegate.xdsHost" -}}
{{- .Values.gateway.xdsHost | default (printf "%s.%s.svc" (include "wakegate.component" (dict "root" . "component" "xds")) .Release.Namespace) -}}
{{- end -}}

{{/* The scaler Service's DNS name. */}}
{{- define "wakegate.scalerService" -}}
{{- printf "%s.%s.svc" (include "wakegate.component" (dict "root" . "component" "scaler")) .Release.Namespace -}}
{{- end -}}

{{/* The Secret holding the internal token: the user's, or the one this chart creates. */}}
{{- define "wakegate.internalTokenSecret" -}}
{{- .Values.internalToken.existingSecret | default (printf "%s-internal-token" (include "wakegate.fullname" .)) -}}
{{- end -}}

{{/* The generated token (base64), the same wherever it is included in one render: the existing
Secret's on upgrade, else a random one made once and kept in .Values for the rest of the render. */}}
{{- define "wakegate.internalTokenValue" -}}
{{- if not (hasKey .Values "generatedInternalToken") -}}
{{- $token := randAlphaNum 48 | b64enc -}}
{{- with (lookup "v1" "Secret" .Release.Namespace (include "wakegate.internalTokenSecret" .)) -}}
{{- with .data }}{{ with .token }}{{ $token = . }}{{ end }}{{ end -}}
{{- end -}}
{{- $_ := set .Values "generatedInternalToken" $token -}}
{{- end -}}
{{- .Values.generatedInternalToken -}}
{{- end -}}

{{/* Pods that hold the token restart together when a generated token changes (an upgrade that
could not read the old Secret, or `helm template` rendered anew), so no two disagree. A digest,
not the token. Nothing for a named Secret: the user rolls the pods when they rotate it. */}}
{{- define "wakegate.internalTokenChecksum" -}}
{{- if not .Values.internalToken.existingSecret -}}
checksum/internal-token: {{ include "wakegate.internalTokenValue" . | sha256sum | trunc 16 }}
{{- end -}}
{{- end -}}

{{/* WAKEGATE_INTERNAL_TOKEN from that Secret (an environment variable: never in args, and no volume). */}}
{{- define "wakegate.internalTokenEnv" -}}
- name: WAKEGATE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "wakegate.internalTokenSecret" . }}
      key: {{ if .Values.internalToken.existingSecret }}{{ .Values.internalToken.key }}{{ else }}token{{ end }}
{{- end -}}

{{/* Whether Models may take the native path (Envoy routes a warm `routing.path: native` Model
alone): only where the gateway checks no API keys and no global rate limit, which Envoy's native
routes would skip. The feeder and the operator get --native-path, extproc --envoy-admin. */}}
{{- define "wakegate.nativePath" -}}
{{- if and (not .Values.gateway.apiKeys.existingSecret) (eq (float64 .Values.gateway.globalRps) 0.0) }}true{{ end -}}
{{- end -}}

{{/* Whether the scaler's KEDA port speaks TLS: a named Secret, or the chart's own certificates. */}}
{{- define "wakegate.scalerTLSOn" -}}
{{- if or .Values.scaler.tlsSecret .Values.scaler.tls.generate }}true{{ end -}}
{{- end -}}

{{/* The Secret the scaler reads its server certificate (and the client CA) from. */}}
{{- define "wakegate.scalerTLSSecret" -}}
{{- .Values.scaler.tlsSecret | default (printf "%s-scaler-tls" (include "wakegate.fullname" .)) -}}
{{- end -}}

{{/* The generated mTLS material of the KEDA port (only without scaler.tlsSecret), the same
wherever it is included in one render: read back from the Secrets on upgrade (lookup), else a
new CA, a server certificate for the scaler Service's names (and operator.scalerHost) and
KEDA's client certificate, all signed by that CA and kept in .Values for the rest of the
render. Every value base64, as Secret data wants it. */}}
{{- define "wakegate.scalerTLSData" -}}
{{- if not (hasKey .Values "generatedScalerTLS") -}}
{{- $ns := .Release.Namespace -}}
{{- $server := lookup "v1" "Secret" $ns (include "wakegate.scalerTLSSecret" .) -}}
{{- $clientNs := first (.Values.scaler.tls.modelNamespaces | default (list $ns)) -}}
{{- $client := lookup "v1" "Secret" $clientNs .Values.scaler.tls.kedaClientSecret -}}
{{- $data := dict -}}
{{- if and $server $client $server.data $client.data -}}
{{- $data = dict "ca" (index $server.data "ca.crt") "serverCert" (index $server.data "tls.crt") "serverKey" (index $server.data "tls.key") "clientCert" (index $client.data "tls.crt") "clientKey" (index $client.data "tls.key") -}}
{{- else -}}
{{- $service := include "wakegate.component" (dict "root" . "component" "scaler") -}}
{{- $names := list $service (printf "%s.%s" $service $ns) (printf "%s.%s.svc" $service $ns) (printf "%s.%s.svc.cluster.local" $service $ns) -}}
{{- $ips := list -}}
{{- with .Values.operator.scalerHost -}}
{{- if regexMatch "^[0-9.]+$|:" . }}{{ $ips = append $ips . }}{{ else }}{{ $names = append $names . }}{{ end -}}
{{- end -}}
{{- $ca := genCA (printf "%s-scaler-ca" (include "wakegate.fullname" .)) 3650 -}}
{{- $serverPair := genSignedCert $service $ips $names 3650 $ca -}}
{{- $clientPair := genSignedCert "keda" nil nil 3650 $ca -}}
{{- $data = dict "ca" ($ca.Cert | b64enc) "serverCert" ($serverPair.Cert | b64enc) "serverKey" ($serverPair.Key | b64enc) "clientCert" ($clientPair.Cert | b64enc) "clientKey" ($clientPair.Key | b64enc) -}}
{{- end -}}
{{- $_ := set .Values "generatedScalerTLS" $data -}}
{{- end -}}
{{- toJson .Values.generatedScalerTLS -}}
{{- end -}}

{{/* The scaler restarts when its generated certificate changes (a digest, not the key). */}}
{{- define "wakegate.scalerTLSChecksum" -}}
{{- if and (not .Values.scaler.tlsSecret) .Values.scaler.tls.generate -}}
checksum/scaler-tls: {{ include "wakegate.scalerTLSData" . | sha256sum | trunc 16 }}
{{- end -}}
{{- end -}}
