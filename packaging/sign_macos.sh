#!/bin/sh
# Sign dist/MLX Desk.app with the hardened runtime, ready for notarisation.
#
#   MLX_DESK_SIGN_IDENTITY="Developer ID Application: Your Name (TEAMID)" packaging/sign_macos.sh [APP]
#
# APP defaults to "dist/MLX Desk.app". The identity must be in your keychain
# (`security find-identity -v -p codesigning` lists them).
set -eu

app="${1:-dist/MLX Desk.app}"
here="$(cd "$(dirname "$0")" && pwd)"
identity="${MLX_DESK_SIGN_IDENTITY:?set MLX_DESK_SIGN_IDENTITY to a Developer ID Application identity}"
[ -d "$app" ] || { echo "sign_macos.sh: $app not found; run 'make bundle' first" >&2; exit 1; }

# --deep signs every nested library and framework first; --options runtime turns
# on the hardened runtime that notarisation requires; --timestamp adds Apple's
# secure timestamp.
codesign --force --deep --timestamp --options runtime \
    --entitlements "$here/entitlements.plist" --sign "$identity" "$app"

codesign --verify --deep --strict --verbose=2 "$app"
echo "signed: $app"
