from cachectl.cli import main

main()
