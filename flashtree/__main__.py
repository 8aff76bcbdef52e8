from flashtree.cli import main

main()
