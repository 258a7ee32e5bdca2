#!/usr/bin/env bash
# Installs the SWORD modules behind the offline Bible corpus (dataset 'bible_en_es'):
# sword-text-kjv (engKJV2006eb, King James) and sword-text-sparv (spaRV1909eb, Reina-Valera
# 1909), both public domain. The builder reads the module files directly; diatheke is not
# needed. As root, installs what is missing with apt-get; otherwise prints the command.
set -euo pipefail

packages=(sword-text-kjv sword-text-sparv)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "SWORD modules present: ${packages[*]}"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q "${missing[@]}"
  echo "Installed: ${missing[*]}"
else
  echo "Missing Debian packages: ${missing[*]}. Install them with:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
