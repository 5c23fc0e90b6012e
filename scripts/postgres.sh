#!/usr/bin/env bash
# Start a throwaway PostgreSQL on 127.0.0.1 for the ledger's PostgreSQL tests and print its
# SQLAlchemy URL. Best effort: prints nothing (and exits 0) when no server can be had.
set -uo pipefail
PORT="${LEDGER_PG_PORT:-54329}"
find_bin() {
  for dir in /usr/lib/postgresql/*/bin; do [ -x "$dir/$1" ] && { echo "$dir/$1"; return; }; done
  command -v "$1" || true
}
INITDB=$(find_bin initdb)
if [ -z "$INITDB" ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null 2>&1
  INITDB=$(find_bin initdb)
fi
[ -n "$INITDB" ] || exit 0
PG_CTL="$(dirname "$INITDB")/pg_ctl"
DIR=$(mktemp -d /tmp/ledger-pg.XXXXXX)
RUNAS=()
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || exit 0
  chown postgres "$DIR"
  RUNAS=(runuser -u postgres --)
fi
"${RUNAS[@]}" "$INITDB" -D "$DIR/data" -A trust -U postgres >/dev/null 2>&1 || exit 0
"${RUNAS[@]}" "$PG_CTL" -D "$DIR/data" -l "$DIR/log" -w \
  -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1" start >/dev/null 2>&1 || exit 0
echo "$DIR/data" > /tmp/ledger-pg.datadir
echo "postgresql+psycopg://postgres@127.0.0.1:$PORT/postgres"
