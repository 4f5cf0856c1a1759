print('old')
