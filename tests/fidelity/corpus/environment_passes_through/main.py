# The user's own variables reach the script, PATH and the locale too.
# env: MYAPP_MODE=fast
# env: MYAPP_LEVEL=3
# expect-stdout: "MYAPP_MODE=fast MYAPP_LEVEL=3\n"
import os
import shutil

print(f"MYAPP_MODE={os.environ['MYAPP_MODE']} MYAPP_LEVEL={os.environ['MYAPP_LEVEL']}")
print("PATH same:", os.environ["PATH"] == os.defpath or bool(os.environ["PATH"]))
print("sort found:", shutil.which("sort") is not None, "LANG:", os.environ.get("LANG"))
print("PWD set:", "PWD" in os.environ)
