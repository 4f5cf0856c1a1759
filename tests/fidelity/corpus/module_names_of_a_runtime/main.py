# Neighbours named wire, runtime, capture, serve: each is the project's.
# expect-stdout: "wire runtime capture serve\n"
import capture
import runtime
import serve
import wire

print(wire.NAME, runtime.NAME, capture.NAME, serve.NAME)
