#!/usr/bin/env bash
# torchrun on one machine with nothing reachable from outside it.
# torchrun's rendezvous store listens on every interface; inside a private network namespace
# "every interface" is just loopback. Without unshare (macOS, locked-down containers) it
# falls back to plain torchrun and says so.
#   scripts/torchrun_local.sh --nproc-per-node=2 -m helpers.run allreduce
set -euo pipefail
TORCHRUN=${TORCHRUN:-$(dirname "$0")/../.venv/bin/torchrun}
# torchrun keeps a log folder under /tmp (torchelastic_*) per run unless told where: give it
# one of ours, removed when the run ends (so no exec below: the trap must outlive torchrun).
case " $* " in
  *" --log-dir"*) logs="" ;;
  *) logs=$(mktemp -d -t plab-torchrun-XXXXXX); trap 'rm -rf "$logs"' EXIT; set -- --log-dir="$logs" "$@" ;;
esac
if command -v unshare >/dev/null && command -v ip >/dev/null && unshare -rn true 2>/dev/null; then
  unshare -rn sh -c 'ip link set lo up && exec "$0" "$@"' "$TORCHRUN" --standalone "$@"
  exit
fi
echo "torchrun_local: no private network namespace here; torchrun's store listens on all interfaces" >&2
"$TORCHRUN" --standalone "$@"
