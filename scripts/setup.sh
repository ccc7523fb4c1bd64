#!/usr/bin/env bash
# Installs what cadenza needs to build and run: libtorch (see
# setup-libtorch.sh) and a General MIDI SoundFont for WAV rendering.
# Idempotent and quick when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-libtorch.sh
have_sf=0
for f in /usr/share/sounds/sf2/TimGM6mb.sf2 /usr/share/sounds/sf2/FluidR3_GM.sf2 "${CADENZA_SOUNDFONT:-/nonexistent}"; do
  [ -f "$f" ] && have_sf=1
done
if [ "$have_sf" = 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing a General MIDI SoundFont (timgm6mb-soundfont)" >&2
    (apt-get install -y -q timgm6mb-soundfont >/dev/null 2>&1 ||
      (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q timgm6mb-soundfont >/dev/null 2>&1)) ||
      echo "setup: could not install timgm6mb-soundfont; WAV rendering needs --soundfont" >&2
  else
    echo "setup: no SoundFont found; install timgm6mb-soundfont or set CADENZA_SOUNDFONT" >&2
  fi
fi
