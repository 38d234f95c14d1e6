from .cli.commands import main

main(prog_name="surgeon")
