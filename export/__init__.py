"""Export stage: a checkpoint in, verified deployable artifacts plus manifest.json out."""
