# Modules named like agentloop's top-level packages resolve to the project's own.
# expect-stdout: "engine: project engine\ntests: project tests\nscripts: project scripts\n"
import engine
import scripts
import tests

for module in (engine, tests, scripts):
    print(f"{module.__name__}: {module.WHO}")
