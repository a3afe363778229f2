"""The example job specs and cluster files, installed as `atoll.examples` so they are found from any folder
(`atoll.inputs.input_path`)."""
