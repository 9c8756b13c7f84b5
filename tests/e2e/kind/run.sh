#!/usr/bin/env bash
# End-to-end check of clusterdns on a kind cluster where it replaces both
# kube-proxy and CoreDNS. Needs docker, kind and kubectl on PATH.
#
#   tests/e2e/kind/run.sh            # create, deploy, check, delete the cluster
#   KEEP=1 tests/e2e/kind/run.sh     # leave the cluster running afterwards
#
# Exit code 0 only if every check passed.
set -euo pipefail
cd "$(dirname "$0")/../../.."

CLUSTER=${CLUSTER:-clusterdns-e2e}
IMAGE=${IMAGE:-clusterdns:dev}
KUBE_DNS=10.96.0.10
CTX="kind-$CLUSTER"
k() { kubectl --context "$CTX" "$@"; }
step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
# retry SECONDS CMD...: run CMD until it succeeds or SECONDS pass.
retry() {
  local until=$((SECONDS + $1)); shift
  until "$@"; do
    [ "$SECONDS" -lt "$until" ] || return 1
    sleep 1
  done
}

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "kind/docker not available: $tool missing" >&2; exit 77; }
done

cleanup() { [ -n "${KEEP:-}" ] || kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; }
trap cleanup EXIT

step "create kind cluster $CLUSTER (kubeProxyMode none)"
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
kind create cluster --name "$CLUSTER" --config deploy/kind-cluster.yaml --wait 0s

step "build and load $IMAGE"
docker build -t "$IMAGE" .
kind load docker-image --name "$CLUSTER" "$IMAGE"

step "replace CoreDNS and kube-proxy with clusterdns"
k -n kube-system scale deployment coredns --replicas=0
k apply -f deploy/rbac.yaml -f deploy/configmap.yaml -f deploy/daemonset.yaml
# The agent reaches the API server directly: ClusterIPs work only once it runs.
k -n kube-system set env daemonset/clusterdns \
  KUBERNETES_SERVICE_HOST="$CLUSTER-control-plane" KUBERNETES_SERVICE_PORT=6443
k -n kube-system rollout status daemonset/clusterdns --timeout=180s
k wait --for=condition=Ready nodes --all --timeout=180s

step "deploy testapp"
k apply -f tests/e2e/kind/testapp.yaml
k -n testapp rollout status deployment/testapp --timeout=180s
k -n testapp wait --for=condition=Ready pod/client --timeout=180s
CIP=$(k -n testapp get svc testapp-svc -o jsonpath='{.spec.clusterIP}')
inpod() { k -n testapp exec client -- "$@"; }

step "dig @$KUBE_DNS from a pod"
answer=$(inpod dig +short @"$KUBE_DNS" testapp-svc.testapp.svc.cluster.local A)
[ "$answer" = "$CIP" ] || fail "dig answered '$answer', want $CIP"
echo "ok: $answer"

step "getent hosts through the pod's own resolv.conf"
inpod cat /etc/resolv.conf
got=$(inpod getent hosts testapp-svc | awk '{print $1}')
[ "$got" = "$CIP" ] || fail "getent hosts testapp-svc gave '$got', want $CIP"
echo "ok: $got"

pods() { k -n testapp get pods -l app=testapp -o jsonpath='{.items[*].metadata.name}' | tr ' ' '\n' | sort; }
# reached N: curl the Service by name until N distinct backends answered, only backends.
reached() {
  local want=$1 seen="" name i
  for i in $(seq 1 $((want * 20))); do
    name=$(inpod curl -s --max-time 2 http://testapp-svc:8080/hostname) || continue
    pods | grep -qx "$name" || fail "answer from '$name', not a testapp pod"
    seen=$(printf '%s\n%s\n' "$seen" "$name" | sed '/^$/d' | sort -u)
    [ "$(echo "$seen" | wc -l)" -ge "$want" ] && { echo "ok: reached $(echo $seen)"; return 0; }
  done
  fail "reached only: $(echo $seen)"
}
step "curl http://testapp-svc:8080 reaches every pod"
reached 3

step "NodePort 31218 from a node"
node=$(kind get nodes --name "$CLUSTER" | grep worker | head -1)
nodeip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$node")
docker exec "$node" curl -s --max-time 3 "http://$nodeip:31218/hostname" | grep -q testapp \
  || fail "NodePort 31218 on $nodeip did not answer"
echo "ok"

step "scaling the Deployment changes answers and rules"
k -n testapp scale deployment testapp --replicas=5
k -n testapp rollout status deployment/testapp --timeout=180s
headless_count() { inpod dig +short @"$KUBE_DNS" testapp-headless.testapp.svc.cluster.local A | wc -l; }
retry 20 bash -c "[ \"\$(kubectl --context $CTX -n testapp exec client -- dig +short @$KUBE_DNS testapp-headless.testapp.svc.cluster.local A | wc -l)\" = 5 ]" \
  || fail "headless answer has $(headless_count) addresses, want 5"
sep_count() { docker exec "$node" iptables-save -t nat | grep -c -- '-A KUBE-SVC-.*testapp/testapp-svc:http.* -j KUBE-SEP-' || true; }
retry 20 bash -c "[ \"\$(docker exec $node iptables-save -t nat | grep -c -- '-A KUBE-SVC-.*testapp/testapp-svc:http.* -j KUBE-SEP-')\" = 5 ]" \
  || fail "KUBE-SVC of testapp-svc has $(sep_count) endpoints, want 5"
reached 5

step "deleting the agent pod loses nothing"
agent=$(k -n kube-system get pods -l app.kubernetes.io/name=clusterdns \
  --field-selector "spec.nodeName=$(k -n testapp get pod client -o jsonpath='{.spec.nodeName}')" \
  -o jsonpath='{.items[0].metadata.name}')
before=$(docker exec "$node" iptables-save -t nat | grep -c KUBE-SEP- || true)
k -n kube-system delete pod "$agent" --wait=false
# Established rules stay in the kernel while the agent restarts.
inpod curl -s --max-time 2 "http://$CIP:8080/hostname" | grep -q testapp || fail "traffic lost during agent restart"
k -n kube-system rollout status daemonset/clusterdns --timeout=120s
retry 20 bash -c "[ \"\$(kubectl --context $CTX -n testapp exec client -- dig +short @$KUBE_DNS testapp-svc.testapp.svc.cluster.local A)\" = $CIP ]" \
  || fail "DNS did not come back after the agent restarted"
after=$(docker exec "$node" iptables-save -t nat | grep -c KUBE-SEP- || true)
[ "$after" -ge "$before" ] || fail "rules lost: $before KUBE-SEP lines before, $after after"
reached 5

printf '\nall kind checks passed\n'
