"""Running a training job: the train config, its composition from Hydra, the Trainer, the dry run, run records."""
