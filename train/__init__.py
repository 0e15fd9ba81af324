"""The one training loop: config -> model, data and task -> loop."""
