#!/usr/bin/env bash
# Local observability run: kvcache-node processes on loopback, a real
# Prometheus (Debian's /usr/bin/prometheus) scraping them every second with
# the shipped scrape config and alert rules, and optionally a load and the
# integration test (tests/deploy/observe_test.py).
#
# Usage: scripts/observe.sh [options]
#   --nodes N            nodes to start (default 3)
#   --memory SPEC        --memory of each node (default host:1GiB)
#   --base-port P        node i listens on P+10i (gRPC), P+10i+1 (health),
#                        P+10i+2 (metrics); default 17700
#   --prom-port P        Prometheus port (default 19090)
#   --load               run the load (see LOAD HOOK below) once all is up
#   --test               run the load through tests/deploy/observe_test.py,
#                        stop the nodes (SIGTERM: they must drain and exit 0),
#                        and exit with the result; without --test the run
#                        stays up until Ctrl-C
#   --save-metrics FILE  after the load, save node 0's /metrics to FILE
#                        (e.g. deploy/testdata/metrics-sample.txt)
#   --keep               keep the work directory (logs, TSDB) on exit
# Environment:
#   KVCACHE_BIN_DIR      where kvcache-node is (default build/service)
#   KVCACHE_DEMO         the load binary (default build/tools/kvcache-demo)
#   KVCACHE_DEMO_ARGS    arguments for it (default --conversations=6 --turns=3:
#                        about 800 MiB per node, ~40 s per node on 2 cores)
#   KVCACHE_LOAD_CMD     replaces the whole load command (a shell command;
#                        KVCACHE_NODES holds the nodes' gRPC host:port list)
#   KVCACHE_NODE_ARGS    extra arguments for every kvcache-node
#   PROMETHEUS           the Prometheus binary (default: prometheus on PATH)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

NODES=3
MEMORY=host:1GiB
BASE_PORT=17700
PROM_PORT=19090
LOAD=0
TEST=0
KEEP=0
SAVE_METRICS=""
while (($#)); do
  case $1 in
    --nodes) NODES=$2; shift ;;
    --nodes=*) NODES=${1#*=} ;;
    --memory) MEMORY=$2; shift ;;
    --memory=*) MEMORY=${1#*=} ;;
    --base-port) BASE_PORT=$2; shift ;;
    --base-port=*) BASE_PORT=${1#*=} ;;
    --prom-port) PROM_PORT=$2; shift ;;
    --prom-port=*) PROM_PORT=${1#*=} ;;
    --load) LOAD=1 ;;
    --test) TEST=1; LOAD=1 ;;
    --save-metrics) SAVE_METRICS=$2; shift ;;
    --save-metrics=*) SAVE_METRICS=${1#*=} ;;
    --keep) KEEP=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "observe: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

BIN_DIR=${KVCACHE_BIN_DIR:-build/service}
NODE_BIN=$BIN_DIR/kvcache-node
DEMO=${KVCACHE_DEMO:-build/tools/kvcache-demo}
PROMETHEUS=${PROMETHEUS:-$(command -v prometheus || echo /usr/bin/prometheus)}
HOST=127.0.0.1

[[ -x $NODE_BIN ]] || { echo "observe: no kvcache-node at $NODE_BIN (build it, or set KVCACHE_BIN_DIR)" >&2; exit 2; }
[[ -x $PROMETHEUS ]] || { echo "observe: no prometheus (apt-get install prometheus, or set PROMETHEUS)" >&2; exit 2; }
((NODES >= 1 && NODES <= 9)) || { echo "observe: --nodes must be 1..9" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvcache-observe.XXXXXX")
NODE_PIDS=()
PROM_PID=""

port_free() { ! (exec 3<> "/dev/tcp/$HOST/$1") 2> /dev/null; }

stop_nodes() { # SIGTERM every node, wait for the drain; prints one line per node
  local rc=0 i pid status
  for pid in "${NODE_PIDS[@]}"; do kill -TERM "$pid" 2> /dev/null || true; done
  for i in "${!NODE_PIDS[@]}"; do
    pid=${NODE_PIDS[$i]}
    status=0
    # --drain-timeout=5 below; allow it plus a margin.
    for _ in $(seq 1 100); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2> /dev/null; then
      echo "node-$i did not exit within 10 s of SIGTERM; killing it"
      kill -KILL "$pid" 2> /dev/null || true
      rc=1
    fi
    wait "$pid" 2> /dev/null || status=$?
    echo "node-$i exited with status $status after SIGTERM"
    ((status == 0)) || rc=1
  done
  NODE_PIDS=()
  return $rc
}

cleanup() {
  set +e
  ((${#NODE_PIDS[@]})) && stop_nodes > /dev/null
  if [[ -n $PROM_PID ]]; then
    kill -TERM "$PROM_PID" 2> /dev/null
    wait "$PROM_PID" 2> /dev/null
  fi
  if ((KEEP)); then echo "observe: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- nodes --------------------------------------------------------------------
GRPC_ADDRS=()
METRICS_ADDRS=()
for ((i = 0; i < NODES; i++)); do
  p=$((BASE_PORT + 10 * i))
  for q in $p $((p + 1)) $((p + 2)); do
    port_free "$q" || { echo "observe: port $q is in use (use --base-port)" >&2; exit 2; }
  done
  GRPC_ADDRS+=("$HOST:$p")
  METRICS_ADDRS+=("$HOST:$((p + 2))")
  # shellcheck disable=SC2086 # KVCACHE_NODE_ARGS is a list of arguments
  "$NODE_BIN" --listen="$HOST:$p" --health-listen="$HOST:$((p + 1))" --metrics-listen="$HOST:$((p + 2))" \
    --memory="$MEMORY" --drain-timeout=5 ${KVCACHE_NODE_ARGS:-} > "$WORK/node-$i.log" 2>&1 &
  NODE_PIDS+=($!)
done
port_free "$PROM_PORT" || { echo "observe: port $PROM_PORT is in use (use --prom-port)" >&2; exit 2; }

for i in "${!NODE_PIDS[@]}"; do
  for _ in $(seq 1 300); do
    curl -fsS -o /dev/null "http://${METRICS_ADDRS[$i]}/metrics" 2> /dev/null && break
    if ! kill -0 "${NODE_PIDS[$i]}" 2> /dev/null; then
      echo "observe: node-$i exited; its log:" >&2
      tail -n 30 "$WORK/node-$i.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  curl -fsS -o /dev/null "http://${METRICS_ADDRS[$i]}/metrics" ||
    { echo "observe: node-$i serves no /metrics after 30 s; log:" >&2; tail -n 30 "$WORK/node-$i.log" >&2; exit 1; }
done

# ---- Prometheus: the shipped scrape config, adapted ---------------------------
python3 - "$ROOT/deploy/prometheus/prometheus.yml" "$WORK/prometheus.yml" "${METRICS_ADDRS[@]}" << 'PY'
import pathlib, sys, yaml
src, dst, targets = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
cfg = yaml.safe_load(src.read_text())
cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
cfg["rule_files"] = [str((src.parent / r).resolve()) for r in cfg.get("rule_files", [])]
(job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "kvcache"]
job["static_configs"] = [{"targets": targets}]
pathlib.Path(dst).write_text(yaml.safe_dump(cfg, sort_keys=False))
PY
"$PROMETHEUS" --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --storage.tsdb.retention.time=1d --web.listen-address="$HOST:$PROM_PORT" \
  > "$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
PROM_URL="http://$HOST:$PROM_PORT"
for _ in $(seq 1 300); do
  curl -fsS -o /dev/null "$PROM_URL/-/ready" 2> /dev/null && break
  kill -0 "$PROM_PID" 2> /dev/null || { echo "observe: prometheus exited:" >&2; tail -n 30 "$WORK/prometheus.log" >&2; exit 1; }
  sleep 0.1
done
curl -fsS -o /dev/null "$PROM_URL/-/ready" || { echo "observe: prometheus not ready after 30 s" >&2; exit 1; }

echo "kvcache nodes:"
for i in "${!NODE_PIDS[@]}"; do
  p=$((BASE_PORT + 10 * i))
  echo "  node-$i  grpc $HOST:$p  health $HOST:$((p + 1))  metrics http://${METRICS_ADDRS[$i]}/metrics  (log $WORK/node-$i.log)"
done
echo "Prometheus: $PROM_URL  (targets $PROM_URL/targets, alerts $PROM_URL/alerts; config $WORK/prometheus.yml)"
echo "  e.g. $PROM_URL/graph?g0.expr=sum%20by%20(instance)%20(kvcache_pool_used_bytes)&g0.tab=0"
echo "Grafana: add $PROM_URL as a Prometheus data source, import deploy/grafana/kvcache-dashboard.json"

# ---- LOAD HOOK ------------------------------------------------------------------
# load_command prints the bash command that loads the nodes. Default: the demo
# client once per node, one after the other (it talks to one node:
# --node=HOST:PORT --metrics=HOST:PORT), with KVCACHE_DEMO_ARGS.
# KVCACHE_LOAD_CMD replaces it entirely.
export KVCACHE_NODES
KVCACHE_NODES=$(IFS=,; echo "${GRPC_ADDRS[*]}")
load_command() {
  if [[ -n ${KVCACHE_LOAD_CMD:-} ]]; then
    echo "$KVCACHE_LOAD_CMD"
    return
  fi
  [[ -x $DEMO ]] || { echo "observe: no load binary at $DEMO (set KVCACHE_DEMO or KVCACHE_LOAD_CMD)" >&2; return 1; }
  local cmd="" demo i
  printf -v demo '%q' "$DEMO"
  for i in "${!GRPC_ADDRS[@]}"; do
    cmd+="${cmd:+ && }$demo --node=${GRPC_ADDRS[$i]} --metrics=${METRICS_ADDRS[$i]} ${KVCACHE_DEMO_ARGS---conversations=6 --turns=3}"
  done
  echo "$cmd"
}
# ----------------------------------------------------------------------------------

save_metrics() {
  [[ -z $SAVE_METRICS ]] && return 0
  curl -fsS "http://${METRICS_ADDRS[0]}/metrics" > "$SAVE_METRICS"
  echo "observe: saved node-0's /metrics to $SAVE_METRICS"
}

if ((TEST)); then
  LOAD_CMD=$(load_command)
  rc=0
  python3 tests/deploy/observe_test.py --prometheus "$PROM_URL" \
    --targets "$(IFS=,; echo "${METRICS_ADDRS[*]}")" --load-cmd "$LOAD_CMD" || rc=$?
  save_metrics || rc=1
  if stop_nodes; then
    echo "ok   every node drained and exited 0 on SIGTERM"
  else
    echo "FAIL a node did not exit 0 on SIGTERM"
    rc=1
  fi
  exit $rc
fi

if ((LOAD)); then
  LOAD_CMD=$(load_command)
  echo "observe: load: $LOAD_CMD"
  bash -c "$LOAD_CMD"
  save_metrics
fi
echo "observe: running; Ctrl-C stops everything"
wait "$PROM_PID"
