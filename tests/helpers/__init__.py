"""What the test modules share: the training harness, the failure-case runners, the CLI runner, the references."""
