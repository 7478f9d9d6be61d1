#!/bin/bash
# usage: start.sh NAME [extra args...]; writes port to NAME.port and pid to NAME.pid
NAME=$1; shift
PORT=$(/work/main/.venv/bin/python -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
/work/main/.venv/bin/kvlens serve --port $PORT --host 127.0.0.1 --max-batch 4 "$@" > /tmp/hostile36-http/server-$NAME.log 2>&1 &
PID=$!
echo $PORT > /tmp/hostile36-http/$NAME.port; echo $PID > /tmp/hostile36-http/$NAME.pid
for i in $(seq 1 240); do
  if curl -s -m 2 http://127.0.0.1:$PORT/health | grep -q ok; then echo "up port=$PORT pid=$PID after $((i/2))s"; exit 0; fi
  if ! kill -0 $PID 2>/dev/null; then echo "died"; tail -20 /tmp/hostile36-http/server-$NAME.log; exit 1; fi
  sleep 0.5
done
echo "not healthy in 120s"; kill $PID; exit 1
