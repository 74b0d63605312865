#!/bin/sh
# Start one kvq worker. It needs only outbound TCP to Redis (and read access to the model source).
#   KVQ_REDIS_URL   required, e.g. rediss://kvq-worker:secret@redis.example.com:6380/0
#   WORKER_ID       optional; unset, kvq keeps an id of its own (<hostname>-<6 hex digits>, in
#                   KVQ_STATE_DIR); must be unique among running workers
#                   (not KVQ_WORKER_ID: kvq refuses KVQ_* names that are not settings, exit 2)
# Every other KVQ_* setting (docs/settings.md) is read by kvq itself.
set -eu

if [ -z "${KVQ_REDIS_URL:-}" ]; then
    echo "run-worker: KVQ_REDIS_URL is not set (e.g. redis://redis.example.com:6379/0)" >&2
    exit 2
fi

# no WORKER_ID: kvq keeps an id of its own (<hostname>-<suffix>, in KVQ_STATE_DIR)
if [ -n "${WORKER_ID:-}" ]; then
    exec kvq worker --id "$WORKER_ID"
fi
exec kvq worker
