# Nothing of a runtime is imported before the script: no zmq, no msgpack, nothing of ours.
# expect-stdout: "zmq False\nmsgpack False\nours []\n"
import sys

print("zmq", "zmq" in sys.modules)
print("msgpack", "msgpack" in sys.modules)
print("ours", sorted(m for m in sys.modules if m.split(".")[0] in ("worker", "engine", "agentloop")))
