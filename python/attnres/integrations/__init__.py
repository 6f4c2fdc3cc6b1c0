"""Engine integrations: plugins that route an inference engine's own AttnRes function to attnres where attnres
was measured faster, and fall back to the engine's function everywhere else (docs/integrations.md).

Nothing here is imported by `import attnres`, and no module here imports an engine at import time: each
plugin's `register()` looks the engine up when the engine calls it. Unlike the library, this layer reads
environment variables (the on/off switches), because an engine loads its plugins with no arguments.
"""
