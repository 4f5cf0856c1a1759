# traceback.print_stack() and inspect.stack(): the script's frames only.
# expect-stderr: 'in <module>\n    outer()'
# expect-stdout: "depth 3: inner outer <module>\n"
import inspect
import traceback


def inner():
    traceback.print_stack()
    frames = inspect.stack()
    print(f"depth {len(frames)}:", " ".join(f.function for f in frames))


def outer():
    inner()


outer()
