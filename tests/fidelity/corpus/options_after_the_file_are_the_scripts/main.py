# Arguments that look like options, -- included, all belong to the script.
# args: --timeout 5 --json -- --bogus -x
# expect-stdout: "['main.py', '--timeout', '5', '--json', '--', '--bogus', '-x']\n"
import sys

print(sys.argv)
