"""`afdserve plan`: the deployment a cluster should run (colocated replicas or xAyF, with or
without expert parallelism, 1-4 ubatches), predicted from a measured profile of one GPU
(`afdserve bench calibrate`) and the model's sizes."""
