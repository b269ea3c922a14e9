from ckptfs.cli import main

main()
