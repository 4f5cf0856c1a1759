# A script beside its own worker.py: the import finds the script's module, as python does.
# expect-stdout: 'worker from the project: 42\n'
import worker

print("worker from the project:", worker.work())
