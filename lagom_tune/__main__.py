from lagom_tune.cli import main

main()
