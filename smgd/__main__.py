from smgd.cli import main

raise SystemExit(main())
