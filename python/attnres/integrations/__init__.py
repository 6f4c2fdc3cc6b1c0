"""Engine integrations (plugins that route an inference engine's AttnRes entry points to attnres). Each submodule
imports without its engine installed; see docs/integrations*.md."""
