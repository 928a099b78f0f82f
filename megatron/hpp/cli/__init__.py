"""Bodies of the runtime's command-line tools, named as in tools/: ``profile_ops`` and
``preprocess_data``.  Nothing imports these but tools/ and the console scripts."""
