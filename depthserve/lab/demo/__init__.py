"""The demo models' training (`depthserve train-demo`): the recipe kit, the loop, each architecture's
recipe and the command line. The task and its tokenizer are depthserve/demo's (the served demo
models use them)."""
