#!/bin/sh
# Notarise a signed dist/MLX Desk.app with Apple and staple the ticket to it.
#
#   packaging/notarize_macos.sh [APP]
#
# Credentials come from the environment, one of:
#   MLX_DESK_NOTARY_PROFILE  a keychain profile made once with
#                           `xcrun notarytool store-credentials PROFILE`
#   MLX_DESK_APPLE_ID, MLX_DESK_TEAM_ID, MLX_DESK_APP_PASSWORD
#                           an Apple ID, its team and an app-specific password
set -eu

app="${1:-dist/MLX Desk.app}"
[ -d "$app" ] || { echo "notarize_macos.sh: $app not found; run 'make bundle' first" >&2; exit 1; }
codesign --verify --deep --strict "$app" || {
    echo "notarize_macos.sh: $app is not signed; run packaging/sign_macos.sh first" >&2; exit 1; }

if [ -n "${MLX_DESK_NOTARY_PROFILE:-}" ]; then
    set -- --keychain-profile "$MLX_DESK_NOTARY_PROFILE"
else
    set -- --apple-id "${MLX_DESK_APPLE_ID:?set MLX_DESK_NOTARY_PROFILE or MLX_DESK_APPLE_ID}" \
           --team-id "${MLX_DESK_TEAM_ID:?set MLX_DESK_TEAM_ID}" \
           --password "${MLX_DESK_APP_PASSWORD:?set MLX_DESK_APP_PASSWORD (an app-specific password)}"
fi

# notarytool takes a zip, a dmg or a pkg; ditto keeps the bundle's symlinks and metadata.
zip="$(mktemp -d)/MLX-Desk.zip"
ditto -c -k --sequesterRsrc --keepParent "$app" "$zip"
xcrun notarytool submit "$zip" "$@" --wait
rm -f "$zip"

# Staple the ticket so Gatekeeper accepts the app offline too.
xcrun stapler staple "$app"
xcrun stapler validate "$app"
spctl --assess --type execute --verbose "$app"
echo "notarised and stapled: $app"
