from benchmark.cli import main

main()
