# A shell-style pipeline built from subprocesses.
# expect-stdout: "      2 b\n"
import subprocess

words = subprocess.Popen(["printf", "b\\na\\nb\\nc\\n"], stdout=subprocess.PIPE)
ordered = subprocess.Popen(["sort"], stdin=words.stdout, stdout=subprocess.PIPE)
words.stdout.close()
counted = subprocess.run(["uniq", "-c"], stdin=ordered.stdout, capture_output=True, text=True)
ordered.wait()
print(counted.stdout, end="")
