"""The demo depth models, trained by `depthserve train-demo` (each folder's train_demo.json holds
the command, the seed and the training curve); served as `demo-put`, `demo-dreamer`, `demo-itt`."""
