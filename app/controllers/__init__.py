"""Controllers: the app's flows between the store, the bridge and the views (a chat's
send/stream/save, model loading, adapters, transcription). No widgets are built here;
views are passed in and driven through the few methods each flow needs."""
