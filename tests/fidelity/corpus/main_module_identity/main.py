# __main__'s loader, spec, name and builtins are python's for a script.
# expect-stdout: "SourceFileLoader None __main__\n"
import sys

main = sys.modules["__main__"]
print(type(main.__loader__).__name__, main.__spec__, __name__)
print(main.__loader__.name, main.__loader__.path == __file__, __cached__, __package__)
print(type(__builtins__).__name__, sorted(k for k in globals() if k.startswith("__")))
