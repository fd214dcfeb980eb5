from jobrun.cli import main

main()
