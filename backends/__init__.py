"""Model loading, sampling and the decode engines specroute routes between."""
