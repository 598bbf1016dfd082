#!/bin/sh
# Notarise a signed dist/MLX Desk.app with Apple and staple the ticket to it.
#
#   packaging/notarize_macos.sh [APP]
#
# Credentials come from the environment, one of:
#   MLXDESK_NOTARY_PROFILE  a keychain profile made once with
#                           `xcrun notarytool store-credentials PROFILE`
#   MLXDESK_APPLE_ID, MLXDESK_TEAM_ID, MLXDESK_APP_PASSWORD
#                           an Apple ID, its team and an app-specific password
set -eu

app="${1:-dist/MLX Desk.app}"
[ -d "$app" ] || { echo "notarize_macos.sh: $app not found; run 'make bundle' first" >&2; exit 1; }
codesign --verify --deep --strict "$app" || {
    echo "notarize_macos.sh: $app is not signed; run packaging/sign_macos.sh first" >&2; exit 1; }

if [ -n "${MLXDESK_NOTARY_PROFILE:-}" ]; then
    set -- --keychain-profile "$MLXDESK_NOTARY_PROFILE"
else
    set -- --apple-id "${MLXDESK_APPLE_ID:?set MLXDESK_NOTARY_PROFILE or MLXDESK_APPLE_ID}" \
           --team-id "${MLXDESK_TEAM_ID:?set MLXDESK_TEAM_ID}" \
           --password "${MLXDESK_APP_PASSWORD:?set MLXDESK_APP_PASSWORD (an app-specific password)}"
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
