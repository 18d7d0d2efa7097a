"""SGLang as a rollout backend: the HTTP client (`engine`), its wire format (`wire`), the server launcher (`server`) and the `Backend` that syncs weights to the servers (`backend`)."""
