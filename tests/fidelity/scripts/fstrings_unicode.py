"""f-strings and text beyond ASCII, both streams."""
import sys

name, value = "größe", 3.14159
print(f"{name!r:>10} = {value:.2f} {value=}")
print("日本語 — ✓ 🐍", "\u00e9", len("🐍"))
print("errors too: ü", file=sys.stderr)
sys.stdout.write("no newline at the end")
