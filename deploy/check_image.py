"""The image's self-check, run at build time in both stages (and by anyone: `python3 /opt/sidecar/check_image.py`).

Fails, naming what is wrong, when pillow-simd lacks a codec (a missing header in the builder or a
missing library in the runtime stage), when plain Pillow shadows it, or when a command is not on PATH.
"""

import shutil
import sys
from importlib import metadata

import PIL.features

CODECS = ("webp", "jpg", "zlib", "littlecms2", "libtiff", "freetype2")
COMMANDS = ("sidecar-ops", "dagster", "ray")

problems = [f"pillow-simd has no {name} support" for name in CODECS if not PIL.features.check(name)]
if any(d.metadata["Name"].lower() == "pillow" for d in metadata.distributions()):
    problems.append("plain Pillow is installed and shadows pillow-simd")
commands = sys.argv[1:] or COMMANDS
problems += [f"{command} is not on PATH" for command in commands if shutil.which(command) is None]
if problems:
    sys.exit("image check failed: " + "; ".join(problems))
print(f"image check: ok (pillow-simd {metadata.version('pillow-simd')}, WebP {PIL.features.version('webp')})")
